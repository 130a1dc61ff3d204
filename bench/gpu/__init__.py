"""The prepared checks for a lent GPU machine (`bash bench/gpu/check.sh`): CPU/GPU byte
identity and the speed of the GPU paths, one process a step; `check.py` lists the steps."""
