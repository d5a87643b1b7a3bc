"""The after-training tools: each a module with its own command, reading a run folder (or
Hugging Face weights) and writing only what it is asked to.

    python sample.py run=<run>                           # tools/sample.py: text
    python -m tools.evaluate run=<run>                   # validation loss, or HellaSwag
    python -m tools.export_hf run=<run> out=exported/    # a Hugging Face folder
    python -m tools.consolidate_checkpoint <run>         # one checkpoint.pt from an FSDP run

What they share: loading.py (the model, the output file, the precision) and generate.py (the
trainer's own generation function). Their validation loss is the trainer's
(recipe/evaluation.py): no tool imports train.py."""
