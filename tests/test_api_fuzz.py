"""Schemathesis, a property-based API fuzzer, against the gateway's own /openapi.json (issue 13):
valid and invalid requests generated from the spec for every operation. No response may be a server
error, and afterwards every service is unharmed. The stack serves a short context (max_model_len
256), so that a fuzzed max_tokens cannot make one request run for minutes."""
from __future__ import annotations

import asyncio
import os
import sys

from .stacks import start, stop
from .test_bad_input import assert_unharmed


async def test_schemathesis_finds_no_server_error(models, tmp_path):
    st = await start(models["tiny-dense"], ex_max_model_len=256)
    try:
        cli = os.path.join(os.path.dirname(sys.executable), "schemathesis")
        proc = await asyncio.create_subprocess_exec(
            cli, "run", st.base + "/openapi.json", "--checks", "not_a_server_error", "--max-examples", "12",
            "--phases", "examples,fuzzing", "--mode", "all", "--request-timeout", "60", "--seed", "1",
            "--suppress-health-check", "all", "--no-color",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, cwd=str(tmp_path))
        out, _ = await asyncio.wait_for(proc.communicate(), 600)
        text = out.decode(errors="replace")
        print(text[-3000:])
        assert proc.returncode == 0, text[-6000:]
        await assert_unharmed(st)
    finally:
        await stop(st)
