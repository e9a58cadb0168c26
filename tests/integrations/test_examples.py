"""Every example in examples/: the two-terminal facade pair as two processes, the async pair
on each event loop."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from helpers import REPO

from llmdd_async.testing import free_port

EXAMPLES = REPO / "examples"


def test_prompt_and_decoder_examples() -> None:
    address = f"127.0.0.1:{free_port()}"
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


@pytest.mark.parametrize("loop", ["asyncio", "uvloop", "trio"])
def test_async_pair_example(loop: str) -> None:
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "async_pair.py"), "--loop", loop],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("bytes match: True") == 2, out.stdout


def test_every_example_is_run() -> None:
    """A new example needs a test here."""
    run_here = {"prompt.py", "decoder.py", "async_pair.py"}
    assert {p.name for p in EXAMPLES.glob("*.py")} == run_here
