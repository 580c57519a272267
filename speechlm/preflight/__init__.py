"""Before a run: the pre-flight checks of a launch (`checks`), `speechlm validate` and its rules
(`validate`, `rules`), `speechlm estimate` (`estimate`) and `speechlm bench` (`bench`). Imports config,
data, model and parallel; never the training layer."""
