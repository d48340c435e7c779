from common.service import main
from services.gateway.server import GatewayService

if __name__ == "__main__":
    main(GatewayService, "gateway")
