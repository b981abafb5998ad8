"""TOML configuration: every ServerConfig/PolicyConfig field, errors that name the key, CLI overrides."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from flared.config import ConfigError, ServerConfig
from flared.scheduler import PolicyConfig

REPO = Path(__file__).resolve().parents[2]


def test_example_config_covers_every_field():
    import tomllib

    data = tomllib.loads((REPO / "systemd" / "flared.toml").read_text())
    server_keys = set(data["server"])
    commented = {line.split("=")[0].strip("# ").strip()
                 for line in (REPO / "systemd" / "flared.toml").read_text().splitlines()
                 if line.startswith("# ") and "=" in line and " = " in line}
    fields = {f.name for f in dataclasses.fields(ServerConfig)} - {"policy"}
    assert fields <= server_keys | commented, fields - server_keys - commented
    assert set(data["policy"]) == {f.name for f in dataclasses.fields(PolicyConfig)}


def test_example_config_loads(tmp_path):
    text = (REPO / "systemd" / "flared.toml").read_text().replace('"/etc/flared/api-key"',
                                                                      f'"{tmp_path / "key"}"')
    (tmp_path / "key").write_text("s3cret\n")
    (tmp_path / "flared.toml").write_text(text)
    cfg = ServerConfig.from_toml(tmp_path / "flared.toml").with_secrets()
    assert cfg.api_key == "s3cret" and cfg.api_key_file is None
    assert cfg.policy == PolicyConfig()
    assert cfg.served_names == ("default",)


@pytest.mark.parametrize("text,key", [
    ("prot = 1", "'prot'"),
    ("port = 70000", "'port'"),
    ("port = true", "'port'"),
    ("frontend_workers = 0", "'frontend_workers'"),
    ("log_format = 'xml'", "'log_format'"),
    ("served_names = 'a'", "'served_names'"),
    ("[policy]\ntoken_fairnes = 1.0", "'policy.token_fairnes'"),
    ("[policy]\ntoken_fairness = 'high'", "'policy.token_fairness'"),
    ("[policy]\nservice_price_adaptation_ns = 1.5", "'policy.service_price_adaptation_ns'"),
    ("[policy]\ntoken_fairness = -1.0", "'policy'"),
    ("api_key = 'a'\napi_key_file = '/x'", "'api_key_file'"),
    ("[server]\nhost = ''", "'host'"),
    ("cors_allow_origins = 'https://a.example'", "'cors_allow_origins'"),
    ("cors_allow_origins = ['a.example']", "'cors_allow_origins'"),
    ("chat_template = '/no/such/template.jinja'", "'chat_template'"),
    ("lora_adapters = '/srv/adapter'", "'lora_adapters'"),
    ("lora_adapters = [['/srv/adapter', 'half']]", "'lora_adapters'"),
    ("lora_adapters = ['/no/such/adapter']", "'lora_adapters'"),
    ("lora_modules = ['sql=/srv/adapter']", "'lora_modules'"),
    ("lora_modules = {sql = '/no/such/adapter'}", "'lora_modules'"),
    ("max_loras = 0", "'max_loras'"),
    ("max_lora_rank = 8.5", "'max_lora_rank'"),
    ("max_cpu_loras = 2", "'max_cpu_loras'"),  # under max_loras (4)
    ("max_cpu_loras = 'many'", "'max_cpu_loras'"),
    ("kv_cache_dtype = 'int4'", "'kv_cache_dtype'"),
    ("kv_cache_dtype = 8", "'kv_cache_dtype'"),
    ("enforce_eager = 'yes'", "'enforce_eager'"),
    ("quantization = 'awq'", "'quantization'"),
])
def test_bad_values_name_the_key(tmp_path, text, key):
    path = tmp_path / "bad.toml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError) as e:
        ServerConfig.from_toml(path)
    assert key in str(e.value) and str(path) in str(e.value)


def test_lora_adapters_are_paths_or_path_scale_pairs_and_lora_modules_a_table(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text("{}")
        (tmp_path / name / "adapter_model.safetensors").write_bytes(b"")
    path = tmp_path / "lora.toml"
    path.write_text(f"lora_adapters = ['{tmp_path / 'a'}', ['{tmp_path / 'b'}', 0.5]]\n")
    cfg = ServerConfig.from_toml(path)
    assert cfg.lora_adapters == ((str(tmp_path / "a"), 1.0), (str(tmp_path / "b"), 0.5))
    path.write_text(f"[lora_modules]\nsql = '{tmp_path / 'a'}'\nchat = '{tmp_path / 'b'}'\n")
    assert ServerConfig.from_toml(path).lora_modules == (("sql", str(tmp_path / "a")), ("chat", str(tmp_path / "b")))


def test_max_cpu_loras_reaches_the_config(tmp_path):
    path = tmp_path / "l.toml"
    path.write_text("runtime_lora_updating = true\nmax_loras = 2\nmax_cpu_loras = 8\n")
    cfg = ServerConfig.from_toml(path)
    assert (cfg.max_loras, cfg.max_cpu_loras) == (2, 8) and ServerConfig().max_cpu_loras is None


def test_kv_cache_dtype_reaches_the_config(tmp_path):
    path = tmp_path / "kv.toml"
    for value in ("fp8", "fp8_e4m3", "auto"):
        path.write_text(f"kv_cache_dtype = '{value}'\n")
        assert ServerConfig.from_toml(path).kv_cache_dtype == value
    assert ServerConfig().kv_cache_dtype == "auto"


def test_enforce_eager_reaches_the_runtime(tmp_path):
    """The flag and the key both set it; on this CPU machine the daemon serves as it would anyway."""
    import subprocess
    import sys

    path = tmp_path / "eager.toml"
    path.write_text("enforce_eager = true\n")
    assert ServerConfig.from_toml(path).enforce_eager and not ServerConfig().enforce_eager
    out = subprocess.run([sys.executable, "-m", "flared.cli.daemon", "run", "--help"], capture_output=True, text=True)
    assert "--enforce-eager" in out.stdout


def test_quantization_reaches_the_config_and_the_cli(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "q.toml"
    path.write_text("quantization = 'q8_0'\n")
    assert ServerConfig.from_toml(path).quantization == "q8_0" and ServerConfig().quantization is None
    out = subprocess.run([sys.executable, "-m", "flared.cli.daemon", "run", "--help"], capture_output=True, text=True)
    assert "--quantization" in out.stdout and "q8_0" in out.stdout


def test_kv_pool_dtype_names():
    import torch

    from flared.model.kv_cache import kv_pool_dtype

    assert kv_pool_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert kv_pool_dtype("fp8", torch.bfloat16) is kv_pool_dtype("fp8_e4m3", torch.float16) is torch.float8_e4m3fn
    with pytest.raises(ValueError, match="auto, fp8, fp8_e4m3"):
        kv_pool_dtype("fp16", torch.bfloat16)


def test_policy_values_reach_the_config(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text("[server]\nport = 0\n[policy]\ntoken_fairness = 2.0\ntiming_freshness_ns = 5\n")
    cfg = ServerConfig.from_toml(path)
    assert cfg.policy.token_fairness == 2.0 and cfg.policy.timing_freshness_ns == 5 and cfg.port == 0


def test_unreadable_api_key_file_names_the_key(tmp_path):
    cfg = ServerConfig(api_key_file=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="api_key_file"):
        cfg.with_secrets()


def test_cli_reports_config_errors_and_exits_2(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[policy]\nnope = 1\n")
    res = subprocess.run([sys.executable, "-m", "flared.cli.daemon", "run", str(tmp_path), "--config", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "policy.nope" in res.stderr and "Traceback" not in res.stderr


def test_journal_logging_when_stderr_is_the_journal(tmp_path):
    # Stderr is a file here; JOURNAL_STREAM names that file's device:inode as systemd would.
    code = ("import logging, os, sys\n"
            "from flared.cli.daemon import configure_logging\n"
            "st = os.fstat(2)\n"
            "configure_logging('info', 'auto', {'JOURNAL_STREAM': f'{st.st_dev}:{st.st_ino}'})\n"
            "logging.getLogger('flared').warning('hello')\n"
            "configure_logging('info', 'auto', {})\n"
            "logging.getLogger('flared').info('plain')\n")
    with open(tmp_path / "err", "w") as err:
        subprocess.run([sys.executable, "-c", code], stderr=err, check=True, timeout=60)
    lines = (tmp_path / "err").read_text().splitlines()
    assert lines[0] == "<4>flared: hello"
    assert lines[1].endswith("INFO flared: plain") and not lines[1].startswith("<")


def test_logs_carry_no_prompt_or_output_text(tiny_core, tmp_path, ops_daemon_cls):
    marker = "zebra-umbrella-4711"
    d = ops_daemon_cls(tiny_core, tmp_path, "--log-level", "debug")
    try:
        status, body = d.chat([{"role": "user", "content": f"Repeat {marker} please."}], max_tokens=8)
        assert status == 200, body
        output = body["choices"][0]["message"]["content"]
        assert d.stop() == 0
    finally:
        d.kill()
    log = d.log()
    assert "listening on" in log  # the log is really there, at debug level
    assert marker not in log
    if len(output.strip()) >= 12:  # a short random-model output could occur in any log by chance
        assert output.strip() not in log
