"""The rank runtime: loaded into every training process without code changes.

boot/sitecustomize.py (on PYTHONPATH via the SPANK plugin) calls
``hook.install()``; once torch.distributed loads, ``init_process_group``
makes a ``ReconfigurablePG`` (pg.py) the default group and starts the
control link (control.py) to the job's coordinator. See docs/runtime.md.
"""

BOOT_DIR_NAME = "boot"


def boot_dir() -> str:
    """The directory to put on PYTHONPATH (the SPANK plugin's runtime_path)."""
    import os

    return os.path.join(os.path.dirname(os.path.abspath(__file__)), BOOT_DIR_NAME)
