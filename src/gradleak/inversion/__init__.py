"""A network inverted from one sample's gradient, layer by layer: the layer inverses
(`inversion.layers`), the conv stack as blocks (`inversion.conv_blocks`) and the walk down it
(`inversion.conv_recovery`). Both attack families read it: the training-free attack on an RL
step's gradient (`gradleak.attacks`) and on a one-image, one-step FedAvg update
(`gradleak.fedavg`)."""
