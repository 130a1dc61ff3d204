"""The benchmark suite (`python -m bench.suite.run`): rates, speed, memory, context and
sessions scaling, and a profile of `seq`, in one run on one machine; `run.py` says how."""
