"""Helpers shared by the unit and integration tests: one in-memory Slurm (fake_slurm) and one
poll-until (wait). The tests/ directory is on sys.path (pytest's rootdir conftest), so tests
import them as ``support.fake_slurm`` and ``support.wait``."""
