"""The bundled demo: a small MoE and a task it learns in a minute."""
