"""The hazard catalogue: each scenario written once as a program of steps.

``catalogue`` holds the scenarios, ``program`` the step language and the reference model,
``trace`` the one mapping from a program to a trace for the checker.
"""

from kvverify.scenarios.catalogue import COPY_KIND, DIRECTIONS, LOAD, SCENARIOS, STORE, Params, Scenario, get, select
from kvverify.scenarios.program import Program, ProgramError
from kvverify.scenarios.contract import contract, to_trace

__all__ = ["COPY_KIND", "DIRECTIONS", "LOAD", "SCENARIOS", "STORE", "Params", "Program", "ProgramError", "Scenario",
           "contract", "get", "select", "to_trace"]
