"""What the launcher knows of a checkpoint without loading it: where the model is, the Hugging
Face directory it is read from (a GGUF converted once), and its config read from config.json.

Plain files (JSON, and a GGUF read with numpy when it is converted), so the HTTP process and the
launcher use it without importing `sluice.model`, which builds on it inside the scheduler.
"""
