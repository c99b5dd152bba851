"""How a model's weights are held on the device: int8 codes and scales beside a master copy kept elsewhere."""
