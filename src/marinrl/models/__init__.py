"""Policy models: built from scratch, loaded from Levanter or Hugging Face checkpoints (`policy_model.py`,
`hf_checkpoints.py`), their tokenizers (`tokenizers.py`) and LoRA adapters on a frozen base (`lora.py`)
(docs/models.md)."""
