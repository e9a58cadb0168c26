"""The torch device adapter's public names (importing this module needs PyTorch).

Select the adapter with the option ``llm.DeviceAdapter=torch`` (and ``llm.TorchDevice``).
"""

from ._devices._torch import TorchAdapter, TorchLayerEvents

__all__ = ["TorchAdapter", "TorchLayerEvents"]
