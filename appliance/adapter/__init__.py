"""What is done with a trained adapter: `appliance eval` (evaluate.py: loss and perplexity on held
out data, beside the base model's), `appliance generate` (generate.py: prompts answered, batched
and streamed like training), `appliance export` (export.py: the adapter merged into the base model's weights) and
the model cards both write (model_card.py); scratch.py: export's scratch directories, and the
cleaning of those a killed export left."""

from appliance.adapter.export import export_merged
from appliance.adapter.model_card import adapter_card, merged_card

__all__ = ["adapter_card", "export_merged", "merged_card"]  # (adapter.evaluate, adapter.generate)
