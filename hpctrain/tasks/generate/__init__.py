"""task=generate: continue prompts with one whole model on one device (`generate`), choosing
each next token (`sampling`). Its settings: hpctrain.config.generate."""
