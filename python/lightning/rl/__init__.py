"""The RL math and the policy update: advantages, PPO-family losses, micro-batch
layouts (padded, packed, tree), tree attention, the trainer and FSDP2."""
