"""The one native part: the server's region JPEG decoder and pack's lossless JPEG rewrite
(server/_jpeg.c), built when it can be.

It needs a C compiler and the headers of libjpeg-turbo 2.1.3 or later (Debian 12, Ubuntu
24.04: gcc libjpeg62-turbo-dev or libjpeg-turbo8-dev; Fedora: gcc libjpeg-turbo-devel).
Without them the install still succeeds, the server decodes whole images with simplejpeg
(the same pixels, about 10% more decode CPU on ImageNet-sized photos than the region
decoder on the original files, 50% more than on packed shards: docs/operator-guide.md, "Decoding"), and
`remoteloader pack` copies files as they are.
Everything else is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("remoteloader.server._jpeg", ["server/_jpeg.c"], libraries=["jpeg"],
                             extra_compile_args=["-O2"], optional=True)])
