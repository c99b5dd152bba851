"""Every model slimopt loads: the LLaMA sizes built from a config, the offline SmolLM2-135M and MiniLM-L6, local
folders and Hugging Face names, with one policy for reaching the hub.

Below ``slimopt.train`` and ``slimopt.finetune`` (docs/design.md, section 1): nothing here trains or imports them.
Details: docs/modules.md, ``slimopt.models``.
"""
