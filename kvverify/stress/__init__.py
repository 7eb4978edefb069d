"""``kvverify stress``: the hazard scenarios run on the GPU, natively and adversarially, every block
checked, each cell's observation joined with its contract verdict.

``campaign`` (TOML files in ``stress/``) → ``running`` (plan, execute) → ``report`` (cells, verdicts,
JSON) → ``render`` (terminal table, JUnit); ``executors/`` run a scenario's program on the device.
"""
