"""SGLang engines (the production rollout path); SGLang itself is imported lazily."""
