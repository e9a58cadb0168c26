"""The two-terminal facade example, run as two processes."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_prompt_and_decoder_examples() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"127.0.0.1:{port}"
    prompt = subprocess.Popen(
        [sys.executable, str(EXAMPLES / "prompt.py"), "--listen", address, "--seconds", "30"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert "serving" in prompt.stdout.readline()
        time.sleep(0.1)
        out = subprocess.run(
            [sys.executable, str(EXAMPLES / "decoder.py"), "--prompt", address],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert out.returncode == 0, out.stderr
        assert "bytes match" in out.stdout
    finally:
        prompt.kill()
        prompt.wait()
