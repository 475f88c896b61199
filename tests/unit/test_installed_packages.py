"""The installed environment does not shadow a dependency with one of Troupe's top-level packages.

Troupe's top level is `kernels/`, the import name of Hugging Face's hub-kernels library too.
transformers probes for that library when it is imported; when it finds the distribution
installed, it imports from whichever `kernels` comes first on the path (ours) and fails.
"""
import importlib.metadata


def test_hugging_face_kernels_is_not_installed_beside_troupe():
    try:
        version = importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return
    raise AssertionError(f"Hugging Face's `kernels` {version} is installed: its import name is Troupe's "
                         f"`kernels` package (a transformers newer than pyproject's pin pulls it in)")

