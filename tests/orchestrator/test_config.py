"""The command line -> EngineConfig (orchestrator/config.py), for the engine's own flags."""

from __future__ import annotations

import argparse
from dataclasses import fields, replace
from pathlib import Path

import pytest

from orchestrator.config import DEFAULT_MODEL, REPO, add_serve_arguments, build_config
from scheduler.executor import choose_channel
from wire import codec
from wire.config import (
    CONFIG_FILE,
    SNAPSHOT_INTERVAL_AUTO,
    ConfigError,
    EngineConfig,
    SpeculativeConfig,
)
from wire.step_channel import supported


def engine_config(*argv: str) -> EngineConfig:
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return build_config(p.parse_args(list(argv)), world_size=2)[0]


def test_the_null_model_is_off_by_default_and_takes_zero(default_model: Path) -> None:
    assert engine_config("--model", str(default_model)).null_model_forward_ms is None
    config = engine_config("--model", str(default_model), "--null-model-forward-ms", "0")
    assert config.null_model_forward_ms == 0.0 and config.world_size == 2
    assert engine_config("--model", str(default_model), "--null-model-forward-ms",
                         "6.4").null_model_forward_ms == 6.4
    with pytest.raises(ValueError, match="null_model_forward_ms"):
        engine_config("--model", str(default_model), "--null-model-forward-ms", "-1")


def test_the_step_channel_is_chosen_where_it_can_serve(default_model: Path) -> None:
    assert engine_config("--model", str(default_model)).step_channel == "auto"
    assert engine_config("--model", str(default_model), "--step-channel",
                         "zmq").step_channel == "zmq"
    auto = EngineConfig(model=str(default_model))
    ipc = "ipc:///tmp/run/workers.sock"
    assert choose_channel(auto, ipc) == ("shm" if supported(ipc) is None else "zmq")
    assert choose_channel(auto, "tcp://10.0.0.1:5555") == "zmq"  # ranks on other hosts
    assert choose_channel(replace(auto, step_channel="zmq"), "ipc:///x/w.sock") == "zmq"
    with pytest.raises(ValueError, match="step channel"):
        EngineConfig(model=str(default_model), step_channel="pipe")


def test_kv_events_are_off_by_default_and_name_the_first_served_model(
        default_model: Path) -> None:
    config = engine_config("--model", str(default_model))
    assert config.kv_events_endpoint == "" and config.kv_events_replay_endpoint == ""
    assert config.served_model_name == default_model.name.removesuffix(".gguf")
    config = engine_config("--model", str(default_model), "--kv-events-endpoint", "5557",
                           "--kv-events-replay-endpoint", "tcp://127.0.0.1:5558",
                           "--served-model-name", "tiny-llama", "claude-sonnet-4-5")
    assert (config.kv_events_endpoint, config.kv_events_replay_endpoint,
            config.served_model_name) == ("5557", "tcp://127.0.0.1:5558", "tiny-llama")
    with pytest.raises(ValueError, match="replay endpoint needs"):
        engine_config("--model", str(default_model), "--kv-events-replay-endpoint", "5558")


def test_the_disk_tier_is_off_by_default_and_needs_the_host_tier(default_model: Path,
                                                                 tmp_path: Path) -> None:
    config = engine_config("--model", str(default_model))
    assert config.disk_cache_dir == "" and config.disk_cache_size == 0
    config = engine_config("--model", str(default_model), "--host-cache-memory", "1000000",
                           "--disk-cache-dir", str(tmp_path / "d"), "--disk-cache-size", "5000")
    assert config.disk_cache_dir == str((tmp_path / "d").resolve())
    assert config.disk_cache_size == 5000
    with pytest.raises(ValueError, match="host tier"):  # turned off: nothing feeds the disk
        engine_config("--model", str(default_model), "--disk-cache-dir", str(tmp_path),
                      "--disk-cache-size", "5000", "--host-cache-memory", "0")
    with pytest.raises(ValueError, match="go together"):
        engine_config("--model", str(default_model), "--disk-cache-size", "5000")


def test_the_disk_tier_writes_through_unless_told_otherwise(default_model: Path,
                                                            tmp_path: Path) -> None:
    """The disk is written from the host tier's copies: with a disk tier the default is
    write-through, so a block reaches the disk as soon as it is computed."""
    assert engine_config("--model", str(default_model)).kv_write_policy == "write_back"
    disk = ("--model", str(default_model), "--host-cache-memory", "1000000",
            "--disk-cache-dir", str(tmp_path / "d"), "--disk-cache-size", "5000")
    assert engine_config(*disk).kv_write_policy == "write_through"
    assert engine_config(*disk, "--kv-write-policy", "write_back").kv_write_policy == "write_back"
    assert engine_config("--model", str(default_model), "--kv-write-policy",
                         "write_through").kv_write_policy == "write_through"


def test_the_model_flag_names_its_true_default() -> None:
    """`deepinfer-run serve --help` says which model is served without --model: the
    flag's own default (the SmolLM2 GGUF), not the tests' tiny model."""
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    model = next(a for a in p._actions if "--model" in a.option_strings)
    default = Path(model.default)
    assert default == DEFAULT_MODEL and default.suffix == ".gguf"
    assert f"(default: {default.relative_to(REPO)}," in model.help
    assert "tiny" not in model.help and ".gguf file" in model.help


def test_every_engine_flag_survives_the_run_directory(default_model: Path,
                                                      tmp_path: Path) -> None:
    """The launcher leaves the EngineConfig in the run directory for the scheduler, which
    sends it on to the ranks: every field comes back equal and of its type, the nested
    speculative config included. (A JSON file read back with EngineConfig(**...) gave the
    scheduler a dict there, and every engine started with --speculative-config exited.)"""
    config = engine_config(
        "--model", str(default_model), "--dtype", "bfloat16", "--device", "cpu",
        "--kv-cache-dtype", "fp8_e5m2",
        "--block-size", "32", "--kv-cache-memory", "1000000", "--gpu-memory-utilization", "0.5",
        "--host-cache-memory", "2000000", "--max-retained-fraction", "0.25", "--session-ttl", "30",
        "--kv-write-policy", "write_through", "--kv-events-endpoint", "5557",
        "--kv-events-replay-endpoint", "5558", "--disk-cache-dir", str(tmp_path / "disk"),
        "--disk-cache-size", "3000000", "--disk-max-queued-writes", "16",
        "--disk-write-bytes-per-s", "1e6", "--no-prefix-caching", "--max-model-len", "256",
        "--max-num-seqs", "8", "--max-num-batched-tokens", "512", "--prefill-pack-tokens", "64",
        "--max-queued-requests", "9",
        "--max-queued-tokens", "100", "--full-cache-check-every", "5", "--step-timeout", "12.5",
        "--attention-backend", "torch", "--torch-threads", "3", "--seed", "7",
        "--null-model-forward-ms", "2.5", "--step-channel", "zmq", "--no-async-scheduling",
        "--served-model-name", "coder", "other", "--state-snapshot-interval", "2",
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, '
                                '"prompt_lookup_max": 5, "prompt_lookup_min": 1}')
    defaults = EngineConfig(model="")
    # every field set away from its default (a GGUF's tokenizer is the launcher's to set)
    assert [f.name for f in fields(EngineConfig)
            if getattr(config, f.name) == getattr(defaults, f.name)] == ["tokenizer"]
    assert config.speculative == SpeculativeConfig("ngram", 3, 5, 1)
    codec.write_file(tmp_path / CONFIG_FILE, config)  # as the launcher does
    back = codec.read_file(tmp_path / CONFIG_FILE, EngineConfig)  # as the scheduler does
    assert back == config
    assert [type(getattr(back, f.name)) for f in fields(EngineConfig)] == [
        type(getattr(config, f.name)) for f in fields(EngineConfig)]
    assert codec.decode(codec.encode(back)) == config  # and on to the ranks


def test_every_engine_setting_comes_from_its_flag_or_is_derived(default_model: Path,
                                                                tmp_path: Path) -> None:
    """build_config copies each EngineConfig field from the flag whose dest is the field's
    name, and derives the rest: a field added without a flag fails here until it gets one
    (or build_config derives it), and each flag's value reaches its field."""
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    dests = set(vars(p.parse_args([])))
    names = {f.name for f in fields(EngineConfig)}
    # no flag of their name: the ranks the launcher counts, the parsed --speculative-config,
    # and the tokenizer the launcher writes for a GGUF model
    assert names - dests == {"world_size", "speculative", "tokenizer"}
    # a value other than the default for every field copied from its flag as it is
    flags = {
        "dtype": (["--dtype", "bfloat16"], "bfloat16"),
        "device": (["--device", "cpu"], "cpu"),
        "kv_cache_dtype": (["--kv-cache-dtype", "fp8"], "fp8"),
        "block_size": (["--block-size", "32"], 32),
        "kv_cache_memory": (["--kv-cache-memory", "123456"], 123456),
        "gpu_memory_utilization": (["--gpu-memory-utilization", "0.5"], 0.5),
        "host_cache_memory": (["--host-cache-memory", "1000000"], 1000000),
        "disk_cache_size": (["--disk-cache-size", "5000"], 5000),
        "disk_max_queued_writes": (["--disk-max-queued-writes", "7"], 7),
        "disk_write_bytes_per_s": (["--disk-write-bytes-per-s", "1e6"], 1e6),
        "enable_prefix_caching": (["--no-prefix-caching"], False),
        "max_retained_fraction": (["--max-retained-fraction", "0.25"], 0.25),
        "session_ttl_s": (["--session-ttl", "30"], 30.0),
        "max_model_len": (["--max-model-len", "128"], 128),
        "max_num_seqs": (["--max-num-seqs", "3"], 3),
        "max_num_batched_tokens": (["--max-num-batched-tokens", "99"], 99),
        "prefill_pack_tokens": (["--prefill-pack-tokens", "64"], 64),
        "max_queued_requests": (["--max-queued-requests", "5"], 5),
        "max_queued_tokens": (["--max-queued-tokens", "1000"], 1000),
        "step_timeout_s": (["--step-timeout", "12.5"], 12.5),
        "full_cache_check_every": (["--full-cache-check-every", "4"], 4),
        "attention_backend": (["--attention-backend", "torch"], "torch"),
        "torch_threads": (["--torch-threads", "2"], 2),
        "seed": (["--seed", "9"], 9),
        "null_model_forward_ms": (["--null-model-forward-ms", "1.5"], 1.5),
        "async_scheduling": (["--no-async-scheduling"], False),
        "step_channel": (["--step-channel", "zmq"], "zmq"),
        "state_snapshot_interval": (["--state-snapshot-interval", "8"], 8),
        "kv_events_endpoint": (["--kv-events-endpoint", "5557"], "5557"),
        "kv_events_replay_endpoint": (["--kv-events-replay-endpoint", "5558"], "5558"),
    }
    derived = {"model", "kv_write_policy", "disk_cache_dir", "served_model_name"}
    assert set(flags) == (names & dests) - derived
    argv = ["--model", str(default_model), "--disk-cache-dir", str(tmp_path / "d"),
            *(arg for given, _ in flags.values() for arg in given)]
    config = build_config(p.parse_args(argv), world_size=3)[0]
    default = EngineConfig(model="")
    for name, (_, value) in flags.items():
        assert getattr(config, name) == value != getattr(default, name), name
    assert (config.model, config.world_size, config.served_model_name) == (
        str(default_model.resolve()), 3, default_model.name.removesuffix(".gguf"))
    assert config.disk_cache_dir == str((tmp_path / "d").resolve())
    assert config.kv_write_policy == "write_through" and config.speculative is None


def test_the_prefill_pack_limit_is_on_for_cpus_and_off_for_gpus(default_model: Path) -> None:
    """--prefill-pack-tokens: 512 on a CPU (a few hundred tokens run at its full rate, so
    prompts arriving together start one after another), 0 on GPUs (a step packs up to its
    budget), or as given; a negative count is refused."""
    model = ("--model", str(default_model))
    assert engine_config(*model, "--device", "cpu").prefill_pack_tokens == 512
    assert engine_config(*model, "--device", "cuda").prefill_pack_tokens == 0
    assert engine_config(*model, "--device", "cuda", "--prefill-pack-tokens", "256"
                         ).prefill_pack_tokens == 256
    assert engine_config(*model, "--prefill-pack-tokens", "0").prefill_pack_tokens == 0
    with pytest.raises(ConfigError, match="prefill_pack_tokens must be >= 0"):
        engine_config(*model, "--prefill-pack-tokens", "-1")


def test_the_kv_cache_dtype_is_the_models_unless_fp8_is_asked_for_on_cpu(
        default_model: Path) -> None:
    """--kv-cache-dtype takes vLLM's names; FP8 is refused where FlashInfer would read it
    (its FP8 KV takes one scale per tensor, not the engine's scale per token and head), at
    launch, with the reason."""
    assert engine_config("--model", str(default_model)).kv_cache_dtype == "auto"
    for name in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        assert engine_config("--model", str(default_model), "--device", "cpu",
                             "--kv-cache-dtype", name).kv_cache_dtype == name
    for device in (("--device", "cuda"), ("--attention-backend", "flashinfer")):
        with pytest.raises(ConfigError, match="fp8 is served on CPU only.*one scale per"):
            engine_config("--model", str(default_model), *device, "--kv-cache-dtype", "fp8")
    with pytest.raises(ConfigError, match="unknown KV cache dtype 'int8'"):
        EngineConfig(model=str(default_model), kv_cache_dtype="int8")
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        engine_config("--model", str(default_model), "--kv-cache-dtype", "fp4")


def test_the_snapshot_interval_is_auto_or_a_count_of_blocks(default_model: Path,
                                                            capsys) -> None:
    """--state-snapshot-interval: `auto` by default (0 in the config: the ranks choose it
    from the bytes), or a whole number of blocks >= 1; anything else stops the launch with
    argparse's usage error naming what is accepted."""
    model = ("--model", str(default_model))
    assert engine_config(*model).state_snapshot_interval == SNAPSHOT_INTERVAL_AUTO
    for text in ("auto", "AUTO", " auto "):
        assert engine_config(*model, "--state-snapshot-interval",
                             text).state_snapshot_interval == SNAPSHOT_INTERVAL_AUTO
    for text, blocks in (("1", 1), ("4", 4), ("197", 197)):
        assert engine_config(*model, "--state-snapshot-interval",
                             text).state_snapshot_interval == blocks
    for text in ("0", "-3", "four", "1.5", ""):
        capsys.readouterr()
        with pytest.raises(SystemExit) as stopped:
            engine_config(*model, "--state-snapshot-interval", text)
        assert stopped.value.code == 2
        err = capsys.readouterr().err
        assert "--state-snapshot-interval" in err and "not a snapshot interval" in err, err
        assert "give `auto`" in err and ">= 1" in err
