"""Replays of the real ``llm_datadist`` clients (``clients.md``) on ``llmdd_async.sync``.

Every client has a prompt-side and a decoder-side function that make the same calls, in the
same order and with the same argument shapes, as that client does (section numbers refer to
``clients.md``). Upstream allows one initialised ``LLMDataDist`` per process, so each side runs
in its own spawned process (``_common.run_replay``). What the real deployments exchange out of band
(zmq metadata, xLLM's RPC, torch.distributed barriers, files) goes through a
:class:`Peer`: a barrier shared by all processes of a replay and an inbox per process.

Only ``127.0.0.1`` is used and every port comes from the test (bound to port 0 first). The
samples' fixed ports (26000, 26001, ...) map to such free ports. Memory is host memory: the
default "host" device adapter treats ``Placement.DEVICE`` addresses as host addresses, so
numpy arrays' ``ctypes.data`` stand in for ``tensor.data_ptr()``. Prompt data comes from
:func:`pattern` with fixed seeds, and decoders check the received bytes against it.

Deviations from a client's exact calls are marked ``DEVIATION`` in the code.

One module per client (``vllm_v1``, ``vllm_v0``, ``mindie``, ``omni``, ``sglang``, ``cann``,
``cann_multi_device``, ``torchair``, ``xllm``) and ``concurrency``; ``_common`` holds the process
harness and the memory helpers.
"""
