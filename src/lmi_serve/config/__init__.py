"""Configuration: serving.properties and the environment in, validated immutable objects out."""
