"""The scheduler-worker contract, on the ground floor so that both services stand on it and
neither imports the other.

    plan.py        StepPlan / StepResult and their parts: what a worker is told and answers
    sampling.py    SamplingParams (OpenAI names) and InvalidRequestError (names the field)
    plan_codec.py  those dataclasses to and from the `sluice.v1` worker protos, and the
                   per-stream state that shortens steady decode steps
    profile.py     ModelSpec, BatchShape and the WorkerProfile file: what `sluice profile`
                   measures on a worker and the cost models read

Frozen, slotted dataclasses with no dependencies beyond the generated code: one definition
on both sides keeps the simulator, the live scheduler and the worker in agreement about a step.
"""
