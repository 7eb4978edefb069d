"""The hazard catalogue: each scenario written once as a program of steps.

``catalogue`` holds the scenarios, ``program`` the step language and the reference model,
``trace`` the one mapping from a program to a trace for the checker.
"""

from kvverify.scenarios.catalogue import SCENARIOS, Params, Scenario, get, select
from kvverify.scenarios.contract import contract, to_trace
from kvverify.scenarios.program import Program, ProgramError

__all__ = ["SCENARIOS", "Params", "Program", "ProgramError", "Scenario",
           "contract", "get", "select", "to_trace"]
