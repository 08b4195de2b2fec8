"""task=eval: a checkpoint's loss and perplexity (`evaluate`) and lm-eval's tasks through
hpctrain's model (`lm_eval_adapter`). Its settings: hpctrain.config.eval."""
