"""torchpass rank runtime bootstrap (on PYTHONPATH in torchpass jobs).

Cheap and harmless: without TORCHPASS_JOB_ID, or with TORCHPASS_RUNTIME=0, it
does nothing but chain to the next sitecustomize on sys.path. Otherwise it
installs an import hook (torch is not imported here). Any error prints one
``torchpass: ...`` line and training runs unprotected.
"""


def _torchpass_boot():
    import os
    import sys

    here = os.path.dirname(os.path.realpath(__file__))

    def chain():
        # Run the sitecustomize this file shadows, if any.
        import importlib.machinery
        import importlib.util

        rest = [p for p in sys.path if os.path.realpath(p or os.curdir) != here]
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
        if spec is None or spec.loader is None:
            return
        mod = importlib.util.module_from_spec(spec)
        sys.modules["_torchpass_chained_sitecustomize"] = mod
        spec.loader.exec_module(mod)

    try:
        if os.environ.get("TORCHPASS_RUNTIME", "1") != "0" and os.environ.get("TORCHPASS_JOB_ID"):
            try:
                import torchpass.runtime.hook as hook
            except ImportError:
                # The training env may lack torchpass: use the installation this
                # file belongs to, after the user's own paths.
                sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(here))))
                import torchpass.runtime.hook as hook
            hook.install()
    except Exception as exc:  # noqa: BLE001 - never break the training process
        try:
            sys.stderr.write(
                f"torchpass: runtime not loaded ({type(exc).__name__}: {exc}); training runs unprotected\n")
        except Exception:  # noqa: BLE001
            pass
    try:
        chain()
    except Exception as exc:  # noqa: BLE001
        try:
            sys.stderr.write(f"torchpass: the chained sitecustomize failed ({type(exc).__name__}: {exc})\n")
        except Exception:  # noqa: BLE001
            pass


_torchpass_boot()
del _torchpass_boot
