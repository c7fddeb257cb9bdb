"""The scheduling core shared by the simulator and the live service.

Data flows `Request -> Scheduler.schedule(now) -> StepPlan -> executor -> StepResult ->
Scheduler.on_step_result(result, now)`; the policy decides inside `schedule` through a
`StepBuilder`, and `kvstore.accounting` owns the block ids. No torch, no wall clock, no I/O.
"""
