"""What `parallel/` knows of a model's attribute names, in one place per family: llama (dense blocks) and
moe (its MoE feed-forwards). A dimension asks the plan, never the model's attributes."""
