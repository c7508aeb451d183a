"""A TF1 program reaching TensorFlow's session classes by every route programs use.

    python session_routes.py

Per route it trains a small net for two steps on a new graph and prints
`loss <route> <step> <value>`; nothing in it knows about tfmem.  The routes:

compat_module     import tensorflow.compat.v1 as tf; tf.Session()  (as tf_upgrade_v2 writes)
from_compat       from tensorflow.compat.v1 import Session
tf_compat         import tensorflow as tf; tf.compat.v1.Session()
client_module     tensorflow.python.client.session.Session
interactive       tf.InteractiveSession() of tensorflow.compat.v1, run by Tensor.eval
imported_model    model code in another module that creates the session itself
"""

import numpy as np
import tensorflow as tf2
import tensorflow.compat.v1 as tf
from tensorflow.compat.v1 import Session
from tensorflow.python.client import session as client_session

import routes_model

tf.disable_eager_execution()


def _train(route, make_session, by_eval=False):
    with tf.Graph().as_default():
        x, loss, train, init = routes_model.model()
        sess = make_session()
        sess.run(init)
        for step in range(2):
            feed = {x: np.full((4, 3), 0.1 * (step + 1), np.float32)}
            if by_eval:
                train.run(feed)
                value = loss.eval(feed)
            else:
                value = sess.run([train, loss], feed)[1]
            print(f"loss {route} {step} {value:.9e}", flush=True)
        sess.close()


def main():
    _train("compat_module", lambda: tf.Session())  # pylint: disable=unnecessary-lambda
    _train("from_compat", lambda: Session())  # pylint: disable=unnecessary-lambda
    _train("tf_compat", lambda: tf2.compat.v1.Session())
    _train("client_module", lambda: client_session.Session())
    _train("interactive", lambda: tf.InteractiveSession(), by_eval=True)
    _train("imported_model", routes_model.new_session)


if __name__ == "__main__":
    main()
