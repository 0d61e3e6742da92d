"""The first step: what compiling costs before a model trains or serves, and what makes compile fail to pay."""
