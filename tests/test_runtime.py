"""shared/: configs, logging, message schemas."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from radixflow.shared import schemas
from radixflow.shared.config import ExecutorConfig, GatewayConfig, load

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_schemas_in_repo_match_the_messages():
    drift = schemas.check(os.path.join(ROOT, "schemas"))
    assert not drift, "run `radixflow schemas`: " + "; ".join(drift)


def test_schema_drift_is_detected(tmp_path):
    schemas.write(str(tmp_path))
    assert schemas.check(str(tmp_path)) == []
    p = tmp_path / "SamplingParams.json"
    doc = json.loads(p.read_text())
    doc["$defs"]["SamplingParams"]["properties"].pop("top_p")
    p.write_text(json.dumps(doc))
    (tmp_path / "Gone.json").write_text("{}")
    drift = schemas.check(str(tmp_path))
    assert any("SamplingParams" in d for d in drift) and any("Gone" in d for d in drift)


def test_configs_are_frozen_and_take_env_overrides():
    env = {"RADIXFLOW_EXECUTOR_PAGE_SIZE": "32", "RADIXFLOW_EXECUTOR_DISABLE_RADIX_CACHE": "true",
           "RADIXFLOW_GATEWAY_API_KEYS": "k1:t1, k2"}
    ex = load(ExecutorConfig, env=env, model="/m")
    assert (ex.page_size, ex.disable_radix_cache, ex.model) == (32, True, "/m")
    assert load(ExecutorConfig, env=env, page_size=8).page_size == 8          # explicit beats env
    assert load(GatewayConfig, env=env).api_keys == ("k1:t1", "k2")
    with pytest.raises(Exception):
        ex.page_size = 1
    with pytest.raises(ValueError, match="RADIXFLOW_EXECUTOR_PAGE_SIZE"):
        load(ExecutorConfig, env={"RADIXFLOW_EXECUTOR_PAGE_SIZE": "big"})
    with pytest.raises(TypeError):
        load(ExecutorConfig, env={}, no_such_field=1)


def test_json_logs_carry_the_request_id():
    code = ("from radixflow.shared import log\n"
            "l = log.get('t')\n"
            "with log.bind_request('rid-123'):\n    l.info('inside', x=1)\n"
            "l.info('outside')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=os.environ | {"RADIXFLOW_LOG_JSON": "1", "RADIXFLOW_LOG_LEVEL": "info"})
    lines = [json.loads(x) for x in out.stderr.splitlines() if x.startswith("{")]
    assert lines[0]["event"] == "inside" and lines[0]["request_id"] == "rid-123" and lines[0]["x"] == 1
    assert lines[1]["event"] == "outside" and "request_id" not in lines[1]
