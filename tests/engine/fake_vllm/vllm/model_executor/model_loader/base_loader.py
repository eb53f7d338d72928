def process_weights_after_loading(model, model_config, target_device):
    """vLLM's post-load step (a no-op here: the fake's scales are already final)."""
    return None
