"""A stand-in for IPython on the GPU machine (benchmark/gpu/server.sh puts it on the path): sglang/utils.py imports
IPython only for `IPython.display`'s HTML and display, which a server never calls. The real IPython and its
dependencies are 6.8 MiB of the 64 MiB that may travel to that machine."""
