"""`speechlm demo`, the Quick start's main job (`run`): the synthesized demo corpus (`corpus`) and the
translation task built on it (`tasks`)."""
