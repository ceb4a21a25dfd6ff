"""The custom-``train_step`` column of the equivalence matrix: the model's own ``train_step`` written as keras.io's
"Customizing what happens in fit()" guides write it for each backend, logging ``{m.name: m.result() for m in
self.metrics}``. ``custom_step_model(backend)`` returns the ``keras.Model`` subclass (built functionally:
``Model(inputs, outputs)``)."""

import keras


def update_metrics(metrics, loss, y, y_pred):
    for metric in metrics:
        if metric.name == "loss":
            metric.update_state(loss)
        else:
            metric.update_state(y, y_pred)
    return {m.name: m.result() for m in metrics}


class TensorFlowGuideModel(keras.Model):
    """"Customizing what happens in fit() with TensorFlow": GradientTape, compute_loss, optimizer.apply."""

    def train_step(self, data):
        import tensorflow as tf

        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        return update_metrics(self.metrics, loss, y, y_pred)


class JaxGuideModel(keras.Model):
    """"... with JAX": a stateless loss function, jax.value_and_grad, optimizer.stateless_apply. The guide names its
    loss function ``compute_loss_and_updates``, which replaces Keras's own (a different signature) that evaluate's
    test_step calls: the guide writes its own test_step too; here Keras's evaluates."""

    def loss_and_updates(self, trainable_variables, non_trainable_variables, x, y, training=False):
        y_pred, non_trainable_variables = self.stateless_call(trainable_variables, non_trainable_variables, x,
                                                              training=training)
        loss = self.compute_loss(x, y, y_pred)
        return loss, (y_pred, non_trainable_variables)

    def train_step(self, state, data):
        import jax

        trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables = state
        x, y = data
        grad_fn = jax.value_and_grad(self.loss_and_updates, has_aux=True)
        (loss, (y_pred, non_trainable_variables)), grads = grad_fn(
            trainable_variables, non_trainable_variables, x, y, training=True)
        trainable_variables, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables)
        new_metrics_vars, logs = [], {}
        for metric in self.metrics:
            this_metric_vars = metrics_variables[len(new_metrics_vars):len(new_metrics_vars) + len(metric.variables)]
            if metric.name == "loss":
                this_metric_vars = metric.stateless_update_state(this_metric_vars, loss)
            else:
                this_metric_vars = metric.stateless_update_state(this_metric_vars, y, y_pred)
            logs[metric.name] = metric.stateless_result(this_metric_vars)
            new_metrics_vars += this_metric_vars
        state = (trainable_variables, non_trainable_variables, optimizer_variables, new_metrics_vars)
        return logs, state


def custom_step_model(backend):
    if backend == "torch":  # "... with PyTorch": zero_grad, compute_loss, backward, optimizer.apply under no_grad
        from torch_guides import CustomModel

        return CustomModel
    return {"tensorflow": TensorFlowGuideModel, "jax": JaxGuideModel}[backend]
