"""Settings for the whole test suite (unit and integration)."""

import os

# An illegal phase transition in the coordinator's core raises instead of rolling back
# (torchpass/coordinator/phases.py). Set in the environment, so the coordinators that the
# integration tests' jobs start (sbatch exports it) are strict too.
os.environ["TORCHPASS_STRICT_TRANSITIONS"] = "1"
