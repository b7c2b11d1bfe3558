"""The peer baselines of issue 10 (benchmarks/peer_*.py) and the comparison table
(benchmarks/compare.py), on the `tiny` preset on a CPU.

Each peer runs through its `main(argv)` for 2 optimizer steps (1 warm-up + 1 timed: B moves in
the first, A, whose gradient is 0 while B = 0, in the second) and is held against one real
`appliance bench` run of the same preset: same tokens per step, and, since the peers train the
bench's own weights, LoRA start, tokens and optimizer, the same losses. FSDP2 with
CPUOffloadPolicy runs on a CPU-only torch with gloo (pin_memory off): that path is the one tested.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from appliance.bench import cli as bench_cli
from appliance.bench import step as B
from appliance.models import param_count
from appliance.models.lora import LoraSpec, LoraWeights
from benchmarks import compare
from benchmarks import peers_common as pc

ROOT = Path(__file__).resolve().parents[2]
ARGS = B.PRESETS["tiny"].args
# what compare.py reads of a peer's JSON
COMPARE_FIELDS = {
    "system", "label", "preset", "device", "device_name", "dtype", "shape", "fits", "reason",
    "step_seconds", "tokens_per_second", "peak_gpu_bytes",
}  # fmt: skip


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """One `appliance bench --preset tiny` run on the CPU: 1 warm-up + 1 timed step per mode."""
    path = tmp_path_factory.mktemp("bench") / "appliance.json"
    with contextlib.redirect_stdout(io.StringIO()):
        rc = bench_cli.main(["--preset", "tiny", "--device", "cpu", "--warmup", "1", "--steps", "1",
                     "--json", str(path)])  # fmt: skip
    assert rc == 0
    return json.loads(path.read_text())


def _run_peer(module_name: str, tmp_path_factory) -> dict:
    """`main(argv)` of benchmarks/<module_name>.py on tiny/CPU, its model kept for the checks."""
    module = __import__(f"benchmarks.{module_name}", fromlist=["main"])
    path = tmp_path_factory.mktemp(module_name) / "peer.json"
    kept: dict = {}
    real = pc.run_peer

    def keep(peer, setup, keep_model=False):
        result, extras = real(peer, setup, keep_model=True)
        kept.update(extras)
        return result, extras

    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.setattr(pc, "run_peer", keep)
        rc = module.main(["--preset", "tiny", "--device", "cpu", "--warmup", "1", "--steps", "1",
                          "--json", str(path)])  # fmt: skip
    assert rc == 0
    return {"json": json.loads(path.read_text()), "stdout": out.getvalue(), **kept}


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    return _run_peer("peer_hf_peft", tmp_path_factory)


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    return _run_peer("peer_fsdp2_offload", tmp_path_factory)


@pytest.fixture(params=["hf", "fsdp"])
def peer_run(request):
    return request.getfixturevalue(f"{request.param}_run")


def test_peer_trains_the_bench_tokens_and_model(peer_run, bench_run):
    r = peer_run["json"]
    assert COMPARE_FIELDS <= set(r), COMPARE_FIELDS - set(r)
    assert r["fits"] is True and r["reason"] is None
    assert (r["preset"], r["device"], r["dtype"]) == ("tiny", "cpu", "float32")
    # the same tokens: the bench's per-step count and shape for this preset on a CPU
    cpu = B.PRESETS["tiny"].cpu
    assert r["shape"]["tokens_per_step"] == bench_run["shape"]["tokens_per_step"]
    assert r["shape"]["tokens_per_step"] == cpu.micro_batches * cpu.micro_batch_size * cpu.seq_len
    for k in ("micro_batch_size", "seq_len", "micro_batches"):
        assert r["shape"][k] == bench_run["shape"][k]
    # the same weights, LoRA start, tokens and optimizer: the bench's losses, step by step
    theirs = bench_run["modes"][1]["losses"]  # resident
    assert len(r["losses"]) == len(theirs) == 2
    for ours, ref in zip(r["losses"], theirs, strict=True):
        assert math.isclose(ours, ref, rel_tol=1e-5), (r["losses"], theirs)
    assert r["losses"][1] < r["losses"][0]  # and it learns
    assert r["step_seconds"] > 0 and len(r["step_seconds_all"]) == 1
    assert math.isclose(r["tokens_per_second"], r["shape"]["tokens_per_step"] / r["step_seconds"])
    assert r["peak_gpu_bytes"] is None  # CPU
    assert r["gradient_checkpointing"] is True
    # gradient checkpointing: each micro-batch runs the layer's forward twice (the recompute)
    assert r["attention_calls_per_micro_batch"] == 2
    assert r["lora"] == {"rank": 16, "alpha": 32.0, "dropout": 0.0,
                         "targets": ["q", "k", "v", "o", "gate", "up", "down"],
                         "params": LoraWeights(ARGS, LoraSpec()).num_parameters()}  # fmt: skip
    assert "tokens/s" in peer_run["stdout"]


def test_only_lora_trains_and_every_lora_tensor_moved(peer_run):
    model = peer_run["model"]
    named = dict(model.named_parameters())
    trainable = {n for n, p in named.items() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert all(not p.requires_grad for n, p in named.items() if "lora_" not in n)
    # the 7 projections of every layer, A and B each
    assert len(trainable) == ARGS.num_layers * 7 * 2
    assert (
        sum(named[n].numel() for n in trainable) == LoraWeights(ARGS, LoraSpec()).num_parameters()
    )
    before, after = peer_run["lora_before"], pc.lora_snapshot(model)
    assert set(before) == set(after) == set(LoraWeights(ARGS, LoraSpec()).peft_state_dict())
    # B starts at 0 (PEFT's and the bench's start) and every A and B has moved after 2 steps
    assert all(not before[k].any() for k in before if ".lora_B." in k)
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert sorted(moved) == sorted(before)
    assert peer_run["json"]["lora_tensors_changed"] == peer_run["json"]["lora_tensors"] == 56
    assert peer_run["json"]["trainable_all_lora"] is True


def test_fsdp2_runs_fully_shard_with_cpu_offload_on_gloo(fsdp_run):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    r, model = fsdp_run["json"], fsdp_run["model"]
    assert r["offload"] is True and r["offload_policy"] == "CPUOffloadPolicy(pin_memory=False)"
    assert r["pin_memory"] is False and r["offload_nominal"] is True  # no accelerator here
    assert r["fsdp"]["world_size"] == 1 and r["fsdp"]["backend"] == "gloo"
    layers = model.get_base_model().model.layers
    assert isinstance(model, FSDPModule) and all(isinstance(x, FSDPModule) for x in layers)
    params = list(model.parameters())
    assert all(isinstance(p, DTensor) and p.device.type == "cpu" for p in params)
    assert not dist.is_initialized()  # the one-process group is gone after the run


def test_hf_peft_is_resident_and_plain(hf_run):
    r, model = hf_run["json"], hf_run["model"]
    assert r["resident"] is True and r["autocast"] is False  # fp32 on a CPU
    assert "offload" not in r
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())


def test_a_shape_that_does_not_fit_is_reported_not_raised(monkeypatch):
    """A GPU OOM while building or a base model beyond host memory: `fits: false` + reason."""
    setup = pc.resolve("tiny", "cpu", steps=1, warmup=0)

    def oom(_setup):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 129.00 GiB")

    result, _ = pc.run_peer(pc.Peer("x", "x", build=oom), setup)
    assert result["fits"] is False
    assert result["reason"].startswith("GPU out of memory: CUDA out of memory")
    assert "step_seconds" not in result and result["shape"]["tokens_per_step"] == 1024

    from benchmarks import peer_fsdp2_offload, peer_hf_peft

    monkeypatch.setattr(pc, "host_memory_available", lambda: 2**20)
    for peer in (peer_fsdp2_offload.PEER, peer_hf_peft.PEER):
        result, _ = pc.run_peer(peer, setup)
        assert result["fits"] is False and result["reason"].startswith("host memory: ")
    assert not dist.is_initialized()


def test_flags_are_checked():
    with pytest.raises(ValueError, match="--preset 'qwen3-8b'"):
        pc.resolve("qwen3-8b", "cpu")
    with pytest.raises(ValueError, match="needs a GPU"):
        pc.resolve("7b", "cpu")
    s = pc.resolve("tiny", "cpu", steps=5, warmup=0)
    assert (s.shape.steps, s.shape.warmup, s.dtype) == (5, 0, torch.float32)


def test_config_mapping_matches_the_preset():
    for name in pc.LLAMA_PRESETS:
        args = B.PRESETS[name].args
        cfg = pc.llama_config(args)
        assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (
            args.num_layers, args.hidden_size, args.intermediate_size)  # fmt: skip
        assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
            args.num_heads, args.num_kv_heads, args.head_dim)  # fmt: skip
        assert cfg.tie_word_embeddings == args.tie_word_embeddings
        with torch.device("meta"):
            import transformers

            n = sum(p.numel() for p in transformers.LlamaForCausalLM(cfg).parameters())
        assert n == param_count(args), name


def test_compare_makes_the_table(bench_run, hf_run, fsdp_run, tmp_path):
    paths = {}
    for name, data in (("a", bench_run), ("f", fsdp_run["json"]), ("h", hf_run["json"])):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(data))
    out = tmp_path / "table.md"
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        rc = compare.main(["--appliance", str(paths["a"]), "--peer", str(paths["f"]),
                           "--peer", str(paths["h"]), "--out", str(out)])  # fmt: skip
    assert rc == 0
    table = out.read_text()
    assert table in printed.getvalue()
    rows = [x for x in table.splitlines() if x.startswith("| ") and "---" not in x][1:]
    assert [x.split(" | ")[0] for x in rows] == [
        "| appliance, streamed",
        "| appliance, resident",
        f"| {fsdp_run['json']['label']}",
        f"| {hf_run['json']['label']}",
    ]
    assert all("| 4×2×128 | 1024 |" in x for x in rows)
    assert "not comparable" not in table
    streamed = bench_run["modes"][0]["tokens_per_second"]
    fsdp_ratio = streamed / fsdp_run["json"]["tokens_per_second"]
    assert rows[0].endswith("| 1.00 |")
    assert rows[2].endswith(f"| {fsdp_ratio:.2f} |")
    assert f"streamed ≥ 3× FSDP2-offload throughput: {fsdp_ratio:.2f}×" in table
    assert "streamed ≥ 0.9× resident throughput: " in table


def test_compare_leaves_out_a_peer_that_did_not_finish(bench_run, hf_run, tmp_path, capsys):
    """gpu_proof.sh goes on after a peer dies: the table compares what did finish and says
    what is missing; a missing bench run is an error naming the file."""
    bench, hf = tmp_path / "a.json", tmp_path / "h.json"
    bench.write_text(json.dumps(bench_run))
    hf.write_text(json.dumps(hf_run["json"]))
    out, gone = tmp_path / "table.md", tmp_path / "fsdp2.json"
    rc = compare.main(["--appliance", str(bench), "--peer", str(gone), "--peer", str(hf),
                       "--out", str(out)])  # fmt: skip
    assert rc == 0
    assert (
        f"warning: {gone}: no such file (did the peer finish?); left out" in capsys.readouterr().err
    )
    rows = [x for x in out.read_text().splitlines() if x.startswith("| ") and "---" not in x][1:]
    assert [x.split(" | ")[0] for x in rows][2:] == [f"| {hf_run['json']['label']}"]
    rc = compare.main(["--appliance", str(tmp_path / "none.json"), "--peer", str(hf)])
    assert rc == 1 and "none.json: no such file" in capsys.readouterr().err


def test_compare_flags_runs_of_other_tokens(bench_run, hf_run):
    other = json.loads(json.dumps(hf_run["json"]))
    other["shape"]["seq_len"] = 64
    other["shape"]["tokens_per_step"] = 512
    table = compare.format_table(bench_run, [other])
    assert "not comparable" in table and "hf-peft: shape seq_len 64, the bench's 128" in table


def test_no_ray_or_boto3_needed():
    """The GPU machine has none of them: the scripts import without."""
    code = (
        "import sys\n"
        "for m in ('ray', 'boto3'):\n"
        "    sys.modules[m] = None\n"
        "import benchmarks.peer_fsdp2_offload, benchmarks.peer_hf_peft, benchmarks.compare\n"
    )
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, timeout=120)


def test_the_gpu_configuration_in_bf16_on_a_cpu():
    """bf16 as on CUDA (FSDP2's MixedPrecisionPolicy, transformers' autocast, fp32 adapters),
    on a CPU at a small shape, with tied embeddings (1b's): both peers take the engine's losses."""
    import dataclasses

    from appliance.engine.step import StreamedEngine
    from benchmarks import peer_fsdp2_offload, peer_hf_peft

    args = dataclasses.replace(ARGS, tie_word_embeddings=True)
    shape = B.Shape(micro_batch_size=2, seq_len=32, micro_batches=2, steps=1, warmup=1)
    setup = pc.Setup("tiny", args, torch.device("cpu"), torch.bfloat16, shape)
    engine = StreamedEngine(
        B.SyntheticBlockSource(args, torch.bfloat16),
        LoraWeights(args, LoraSpec(), "cpu", seed=0),
        device="cpu",
        dtype=torch.bfloat16,
    )
    batches = B._batches(args, shape)
    ref = [engine.train_step(batches, B.LR).loss for _ in range(2)]
    for peer in (peer_hf_peft.PEER, peer_fsdp2_offload.PEER):
        result, extras = pc.run_peer(peer, setup, keep_model=True)
        assert result["fits"] and result["dtype"] == "bfloat16"
        for ours, theirs in zip(result["losses"], ref, strict=True):
            assert math.isclose(ours, theirs, rel_tol=1e-4), (peer.system, result["losses"], ref)
        model = extras["model"]
        dtypes = {("lora_" in n, p.dtype) for n, p in model.named_parameters()}
        assert dtypes == {(True, torch.float32), (False, torch.bfloat16)}
        base = model.get_base_model()
        assert base.lm_head.weight is base.model.embed_tokens.weight  # still tied
    assert result["mixed_precision"] == {"param_dtype": "bfloat16", "reduce_dtype": "float32"}


def test_fsdp2s_pinned_weights_are_counted_as_torch_pins_them(monkeypatch):
    """FSDP2's CPU offload on CUDA page-locks each weight on its own through torch's pinned-memory
    allocator, which rounds every allocation up to a power of two: 13B's 24.2 GiB of bf16 take
    41.0 GiB there. A host with 40 GiB available holds the plain weights, not the pinned ones.
    (The host's available memory is the one thing stood in for.)"""
    from appliance.models.hf_checkpoint import expected_shapes

    p = B.PRESETS["13b"]
    setup = pc.Setup("13b", p.args, torch.device("cpu"), torch.bfloat16, p.gpu)
    pinned = sum(1 << (math.prod(s) * 2 - 1).bit_length() for s in expected_shapes(p.args).values())
    assert 41 * pc.GiB < pinned < 41.1 * pc.GiB  # vs 24.2 GiB unpinned
    monkeypatch.setattr(pc, "host_memory_available", lambda: 40 * pc.GiB)
    pc.check_host_memory(setup)  # 24.2 GiB ≤ 90% of 40
    with pytest.raises(
        pc.DoesNotFit, match=r"page-locked .* need 41\.0 GiB, 40\.0 GiB is available"
    ):
        pc.check_host_memory(setup, pinned=True)
