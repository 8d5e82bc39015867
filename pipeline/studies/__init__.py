"""Studies, above the stages: what is made of many runs' results. The tables and reports (TOFU's and MUSE's), the
significance tests over model seeds, the trade-off curves read at equal utility, learning-rate tuning (a run's
curve, bisected onto the utility floor), the diagnosis of where each run's push lands, and the comparison of metric
definitions.

May use: `pipeline.common`, `pipeline.data`, `pipeline.attribution`, `pipeline.training`, `pipeline.evaluation`.
"""
