"""Everything that touches the GPU: the batched swap op, extension loading, its cuda-python twin, the
harness kernels, exact-size host memory, the block pattern and the platform's versions.

Importing this package loads nothing heavy; each module imports torch where it is used."""
