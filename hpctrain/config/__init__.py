"""The run's configuration: every key, its default and its choices as frozen dataclasses (`schema`
for the run's groups, a module per task group), built from Hydra's composed config (`build`,
`parse`), registered with Hydra (`hydra_schema`), explained on the command line (`cli`), and the
rules a configuration must pass (`rule`: one rule and the keys it reads; `validate`: running
them, and the rules of the layout, the model, the batch and the devices)."""
