"""Checkpoints: writing and reading them atomically, when a run saves and resumes, what a resumed run keeps, the
run directory, consolidating to safetensors, and reading them without unpickling."""
