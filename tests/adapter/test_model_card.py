"""Model cards (appliance/adapter/model_card.py): what a card says, read back with huggingface_hub's own
parser; a README.md that is the user's is never overwritten or deleted; export replaces the base
model's card with the merged model's. A card written by a whole run on a hub id:
tests/e2e/test_run_ux.py; on S3 after a resume: tests/e2e/test_s3_e2e.py."""

from __future__ import annotations

import json

from huggingface_hub import ModelCard

from appliance.adapter import model_card
from appliance.adapter.export import export_merged
from appliance.config import build_config
from appliance.run.resume import remove_previous_run
from appliance.storage.hub import CachedRepo, cached_repo
from tests.adapter.test_export import save_random_adapter
from tests.helpers_model import make_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def test_a_path_in_the_hugging_face_cache_is_named_by_its_hub_id():
    hub = "/root/.cache/huggingface/hub"
    assert cached_repo(f"{hub}/models--org--na.me-1/snapshots/{COMMIT}") == CachedRepo(
        "org/na.me-1", COMMIT, ""
    )
    assert cached_repo(f"{hub}/datasets--org--chat/snapshots/{COMMIT}/data/train*", "dataset") == (
        CachedRepo("org/chat", COMMIT, "data/train*")
    )
    for path in (
        f"{hub}/datasets--org--chat/snapshots/{COMMIT}",  # a dataset, asked as a model
        f"{hub}/models--org--name/snapshots/main",  # not a commit
        f"{hub}/models--gpt2/snapshots/{COMMIT}",  # no org: never what a hub id resolved to
        "/models/Llama-2-7b-hf",
        "s3://bucket/models--org--name/snapshots/x",
    ):
        assert cached_repo(path) is None, path


def record(tmp_path, **config) -> dict:
    """A completed run's run.json, as Run.finish writes it."""
    given = {"model": "/m", "data": str(tmp_path / "train.jsonl"), "output": "/o"}
    cfg = build_config({}, {**given, "micro_batches_per_step": 4, **config})
    return {
        "config": cfg.to_dict(),
        "status": "complete",
        "steps": 3,
        "losses": [2.5, 2.0, 1.25],
        "target_tokens": 12345,
        "eval_loss": 1.5,
        "device": "cuda",
        "dtype": "bfloat16",
        "trainers": 2,
        "finished": "2026-11-24",
        "version": "0.1.0",
    }


def test_the_adapter_card_says_what_the_run_did(tmp_path):
    done = record(tmp_path, base_quant="nf4", eval_split=0.05, micro_batches_per_step=8)
    base = model_card.BaseModel("/models/llama")
    adapter = {
        "r": 16,
        "lora_alpha": 32.0,
        "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"],
    }
    text = model_card.adapter_card(done, base, "runs/a", adapter)
    card = ModelCard(text)
    assert card.data.library_name == "peft" and card.data.pipeline_tag == "text-generation"
    assert card.data.base_model is None  # a local path is not a hub id: no metadata for it
    table = text.split("## Training")[1].strip().splitlines()[2:]  # after the header rows
    rows = dict(line.strip("| ").split(" | ", 1) for line in table)
    assert rows == {
        "base model": "`/models/llama`; base weights nf4-quantized while training (QLoRA)",
        "data": "`train.jsonl`, packed by documents",
        "steps": "3 (8 micro-batches of 4 × 256 tokens per step on each of 2 trainers; 12,345 "
        "tokens trained on)",
        "LoRA": "r 16, alpha 32, dropout 0, on q_proj, v_proj",
        "optimizer": "AdamW, lr 0.0002, 10 warm-up steps then cosine decay to 0.1× lr, weight "
        "decay 0, gradient clip 1",
        "precision": "bfloat16 on cuda",
        "seed": "0",
        "training loss": "2.5 at step 1, 1.25 at step 3",
        "held-out loss": "1.5 on 5% of the documents, held out",
        "trained": "2026-11-24 with appliance 0.1.0",
    }
    assert 'PeftModel.from_pretrained(model, "runs/a")' in text
    assert "appliance export --model /models/llama --adapter runs/a --output merged" in text
    assert text.split("---\n")[2].startswith(model_card.MARKER)  # after the front matter


def test_a_readme_that_is_not_appliances_is_never_overwritten_or_deleted(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    run_json = json.dumps({"identity": {"model": "/m"}, "status": "complete"})
    (out / "run.json").write_text(run_json)  # an appliance run: --overwrite replaces it
    (out / "adapter_config.json").write_text(json.dumps({"target_modules": ["q_proj"]}))
    base = model_card.BaseModel("/m")
    readme = out / "README.md"
    readme.write_text("# my notes on this run\n")
    note = model_card.write_adapter_card(record(tmp_path), base, str(out))
    assert note == f"{readme} is not a card appliance wrote: left as it is (no model card written)"
    assert readme.read_text() == "# my notes on this run\n"
    remove_previous_run(str(out))  # --overwrite
    assert readme.read_text() == "# my notes on this run\n"
    assert not (out / "adapter_config.json").exists()  # what --overwrite does delete

    readme.unlink()
    (out / "run.json").write_text(run_json)
    (out / "adapter_config.json").write_text(json.dumps({"target_modules": ["q_proj"]}))
    assert model_card.write_adapter_card(record(tmp_path), base, str(out)) is None
    first = readme.read_text()
    assert "| steps | 3 (" in first
    again = record(tmp_path)
    again["steps"] = 7  # a resumed run completes: its card replaces the first
    assert model_card.write_adapter_card(again, base, str(out)) is None
    assert "| steps | 7 (" in readme.read_text()
    remove_previous_run(str(out))  # --overwrite: the card went with the adapter it described
    assert not readme.exists()


def test_export_replaces_the_base_card_and_carries_its_licence(tmp_path):
    model = make_model(tmp_path / "model", "llama-mha")
    (model / "README.md").write_text(
        "---\nlicense: other\nlicense_name: llama2\nlicense_link: LICENSE\nlanguage: [en]\n"
        "tags: [facebook]\n---\n# Llama 2\nThe base model's card.\n"
    )
    (model / "LICENSE").write_text("the licence")
    adapter = save_random_adapter(model, tmp_path / "adapter")
    out = export_merged(model, adapter, tmp_path / "merged")
    card = ModelCard.load(out / "README.md")
    assert (card.data.license, card.data.license_name, card.data.license_link) == (
        "other",
        "llama2",
        "LICENSE",
    )
    assert card.data.language == ["en"] and card.data.tags == ["lora", "appliance", "merged"]
    assert card.data.library_name == "transformers" and card.data.base_model is None
    assert "The base model's card." not in card.text
    assert model_card.MARKER not in card.text  # nothing rewrites an export: no marker to keep
    assert (out / "LICENSE").read_text() == "the licence"  # the licence file itself, copied
    # an adapter that is not a run's output: the card gives its LoRA settings
    targets = ", ".join(json.loads((adapter / "adapter_config.json").read_text())["target_modules"])
    assert f"| LoRA | r 4, alpha 8, dropout 0, on {targets} |" in card.text

    # a base card whose front matter is not YAML is documentation, not an error
    (model / "README.md").write_text("---\nlicense: [unclosed\n---\ntext\n")
    out = export_merged(model, adapter, tmp_path / "merged-2")
    assert ModelCard.load(out / "README.md").data.license is None


def test_export_of_a_runs_output_gives_the_runs_training_table(tmp_path):
    model = make_model(tmp_path / "model", "llama-mha")
    adapter = save_random_adapter(model, tmp_path / "run")
    done = record(tmp_path)
    (adapter / "run.json").write_text(json.dumps(done))
    text = (export_merged(model, adapter, tmp_path / "merged") / "README.md").read_text()
    assert "| steps | 3 (4 micro-batches" in text and "| held-out loss | 1.5 on" in text
    (adapter / "run.json").write_text(json.dumps({**done, "status": "interrupted"}))
    text = (export_merged(model, adapter, tmp_path / "merged-2") / "README.md").read_text()
    assert "| steps |" not in text and "| LoRA | r 4" in text  # not the adapter's run: settings

    # a checkpoint (OUTPUT/checkpoints/step-N): the run up to that step, from its config and
    # driver state; a validation loss only when it was taken at that step
    step = save_random_adapter(model, tmp_path / "step-000002")
    state = {"step": 2, "losses": [2.5, 2.0], "target_tokens": 999, "trainers": 1,
             "eval_losses": [[1, 2.25], [2, 1.75]]}  # fmt: skip
    config = {**record(tmp_path, eval_split=0.05)["config"], "dtype": "bfloat16", "device": "cuda"}
    for name, content in (("config.json", config), ("driver_state.json", state),
                          ("manifest.json", {"step": 2})):  # fmt: skip
        (step / name).write_text(json.dumps(content))
    text = (export_merged(model, step, tmp_path / "merged-3") / "README.md").read_text()
    assert (
        "| steps | 2 (4 micro-batches of 4 × 256 tokens per step; 999 tokens trained on) |" in text
    )
    assert "| training loss | 2.5 at step 1, 2 at step 2 |" in text
    assert "| held-out loss | 1.75 on 5% of the documents, held out |" in text
    assert "| precision | bfloat16 on cuda |" in text  # as the run resolved it (config.json)
    state["eval_losses"] = [[1, 2.25]]  # validated before this step only: no held-out row
    (step / "driver_state.json").write_text(json.dumps(state))
    (step / "config.json").write_text(json.dumps({**config, "dtype": "auto"}))  # unresolved
    text = (export_merged(model, step, tmp_path / "merged-4") / "README.md").read_text()
    assert "| held-out loss |" not in text and "| steps | 2 (" in text
    assert "| precision |" not in text
