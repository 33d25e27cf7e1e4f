"""Kernels built for an H100/H200 target by Triton's compiler, in a subprocess without the interpreter (which
accepts code the compiler refuses; ptxas ships with Triton, so no GPU is needed). With this environment's
Triton, and also with the GPU machine's when DEVICE_TRITON names a directory holding it (`.ci/run` installs it
there): each Triton version refuses code the other accepts."""
import os
import subprocess
import sys


def tritons() -> list[tuple[str, str | None]]:
    """(which, the directory to import it from: None for the installed one) of each Triton to build with."""
    device = os.environ.get("DEVICE_TRITON")
    return [("installed", None)] + ([("device", device)] if device else [])


def assert_compiles(script: str, *args: str) -> None:
    """`script` (python source that calls triton.compile) runs to its end under every Triton of tritons()."""
    for which, path in tritons():
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        if path is not None:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (path, env.get("PYTHONPATH")) if p)
        done = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, f"the {which} Triton ({path or 'site-packages'}):\n{done.stderr[-3000:]}"
