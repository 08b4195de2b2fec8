"""What one rank of a layout holds at the peak of a step: the planner's one memory model
(`model`), from the engine's flat units (`states`), what the blocks save for backward
(`activations`), and the published formulas it stands on (`formulas`: the ZeRO paper's states,
Korthikanti et al.'s activations) for the shapes hpctrain does not build."""
