"""Iteration-time cost models: one interface (`CostModel.iteration_time(BatchShape)`),
three kinds (analytic roofline, measured operator profiles, fitted worker profile)."""
