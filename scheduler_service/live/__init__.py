"""The live scheduler: the simulator's core (Cluster, Scheduler, policies, router) driven by
the wall clock over real workers.

    Generate --intake.build_request--> LiveScheduler.submit --> Cluster.submit (router, queues)
    WorkerLoop (one asyncio task per worker):
        plan = Scheduler.schedule(now) --> RemoteWorker.execute (Execute stream) --> StepResult
        Scheduler.on_step_result --> RequestStream.push (text delta, stop strings) --> Generate
    a worker that fails --> Cluster.mark_down (its requests recompute elsewhere) --> reconnect

Only this package and the servers read the clock (`time.monotonic`); policies are handed `now`.
"""
