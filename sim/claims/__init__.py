"""``kvsim report claims``: measure public claims about KV memory policies on kvsim's engine.

One Markdown report (plots as PNG beside it) that runs the shipped claims scenario under
each memory policy and answers: how much KV memory static and Orca-style allocation waste
against paging, how many agent sessions one GPU holds within the SLOs per policy, what a
steady-state KV utilization costs in preemptions, and what recompute costs against swap.
"""
