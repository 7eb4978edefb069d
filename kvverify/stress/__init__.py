"""``kvverify stress``: the hazard scenarios run on the GPU, natively and adversarially, every block
checked, each cell's observation joined with its contract verdict.

This package runs campaigns; the campaigns themselves are the TOML files of the top-level
``stress/`` folder (``stress/README.md``: smoke, nightly, soak), data a run reads.

``campaign`` (loads ``stress/*.toml``) → ``running`` (plan, execute) → ``report`` (cells, verdicts,
JSON) → ``render`` (terminal table, JUnit); ``executors/`` run a scenario's program on the device.
"""
