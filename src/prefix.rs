//! Prompt-prefix blocks and the prefix index (work in progress).
