"""The one C module: zephon.media.libjpeg_binding, a region decode through libjpeg-turbo's libjpeg API.

It links nothing at build time (it opens Pillow's bundled libjpeg-turbo with dlopen at run time)
and builds against the 6.2-ABI headers vendored in zephon/media/libjpeg_abi/. `optional=True`:
without a C compiler the package still installs, and JPEG decoding falls back to simplejpeg.
Everything else about the package is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "zephon.media.libjpeg_binding",
            sources=["zephon/media/libjpeg_binding.c"],
            include_dirs=["zephon/media/libjpeg_abi"],
            libraries=["dl"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
